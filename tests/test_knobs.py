"""Tuning knobs (ETDIST_* environment variables): a bad value never breaks `import etdist`, and
the op that reads it raises KnobError naming the variable before anything else happens."""
import os
import subprocess
import sys

import pytest
import torch

from etdist import knobs


def test_a_bad_value_is_kept_for_check_and_the_default_used(monkeypatch):
    monkeypatch.setattr(knobs, "_BAD", {})
    monkeypatch.setenv("ETDIST_TEST_A", "abc")
    monkeypatch.setenv("ETDIST_TEST_B", "7")
    assert knobs.read("ETDIST_TEST_A", knobs.positive_int, 3) == 3
    assert knobs.read("ETDIST_TEST_B", knobs.positive_int, 3) == 7
    assert knobs.read("ETDIST_TEST_UNSET", knobs.positive_int, 3) == 3
    knobs.check("ETDIST_TEST_B", "ETDIST_OTHER")      # not the bad one
    with pytest.raises(knobs.KnobError, match=r"ETDIST_TEST_A='abc': want a positive integer"):
        knobs.check("ETDIST_TEST_")


def test_a_knob_read_where_it_is_used_names_itself(monkeypatch):
    """The collectives read theirs at the first call: ETDIST_BLOCK=abc was int()'s bare ValueError."""
    monkeypatch.setenv("ETDIST_BLOCK", "48")
    with pytest.raises(knobs.KnobError, match=r"ETDIST_BLOCK='48': want a power of two"):
        knobs.now("ETDIST_BLOCK", knobs.power_of_two, 1024)
    monkeypatch.setenv("ETDIST_BLOCK", "")
    assert knobs.now("ETDIST_BLOCK", knobs.power_of_two, 1024) == 1024


@pytest.mark.parametrize("parse,good,bad", [
    (knobs.positive_int, {"1": 1, "64": 64}, ["0", "-3", "1.5", "x"]),
    (knobs.non_negative_int, {"0": 0, "128": 128}, ["-5", "abc"]),
    (knobs.positive_float, {"2": 2.0, "0.5": 0.5}, ["0", "-1", "nan", "inf", "x"]),
    (knobs.flag, {"0": False, "1": True}, ["abc", "2", "yes"]),
    (knobs.power_of_two, {"1": 1, "1024": 1024}, ["0", "3", "48", "x", "-4"]),
    (knobs.tile_width, {"16": 16, "256": 256}, ["8", "0", "48", "x", "-16"]),
])
def test_parsers(parse, good, bad):
    for text, want in good.items():
        assert parse(text) == want
    for text in bad:
        with pytest.raises(ValueError):
            parse(text)


_PROBE = """
import torch, etdist as et
x = torch.zeros(4, 32, dtype=torch.bfloat16); w = torch.zeros(32, 32, dtype=torch.bfloat16)
for name, call in (("gemm_rs", lambda: et.ops.gemm_reduce_scatter(x, w)),
                   ("ag_gemm", lambda: et.ops.all_gather_gemm(x, w)),
                   ("mlp", lambda: et.ops.tensor_parallel_mlp(x, torch.zeros(32, 64, dtype=torch.bfloat16), w))):
    try:
        call()
    except et.KnobError as e:
        print(name, "KnobError", e)
    except Exception as e:
        print(name, type(e).__name__)
"""


@pytest.mark.parametrize("env,named", [
    ({"ETDIST_WHOLE_TILES": "1,2"}, "ETDIST_WHOLE_TILES='1,2'"),
    ({"ETDIST_GEMM_RS_SKINNY": "0,0,0,0,0"}, "ETDIST_GEMM_RS_SKINNY='0,0,0,0,0'"),
    ({"ETDIST_GEMM_RS_SKINNY_TASKS_PER_SM": "nan"}, "ETDIST_GEMM_RS_SKINNY_TASKS_PER_SM='nan'"),
    ({"ETDIST_WHOLE_MAX_M": "-5"}, "ETDIST_WHOLE_MAX_M='-5'"),
    ({"ETDIST_TMA": "abc"}, "ETDIST_TMA='abc'"),
    ({"ETDIST_MLP_DOWN_N": "96"}, "ETDIST_MLP_DOWN_N='96'"),
    ({"ETDIST_GEMM_RS_MAX_SPLITS": "0"}, "ETDIST_GEMM_RS_MAX_SPLITS='0'"),
    ({"ETDIST_INTERLEAVE_SOURCES": "yes"}, "ETDIST_INTERLEAVE_SOURCES='yes'"),
])
def test_the_fused_ops_name_a_bad_tile_knob_before_anything_else(env, named):
    """Before the mesh is even looked up (there is none here): the knob is the first thing wrong."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ETDIST_")}
    p = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]     # import etdist worked
    lines = p.stdout.splitlines()
    assert len(lines) == 3 and all("KnobError" in l and named in l for l in lines), p.stdout


def test_without_bad_knobs_the_ops_go_on_to_their_own_checks():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ETDIST_")}
    p = subprocess.run([sys.executable, "-c", _PROBE], env=clean, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "KnobError" not in p.stdout and p.stdout.count("MeshError") == 3, p.stdout   # next: no mesh initialised


def test_tile_configs_may_ask_for_two_programs_per_sm():
    """"bm,bn,bk,warps,stages[,swap][,2/sm]": the kernel then runs two co-resident persistent
    programs per SM (its cooperative launch refuses if they do not fit); anything but 1 or 2 per SM
    is refused with the format named."""
    from etdist.ops.gemm_rs import TileConfig
    assert TileConfig.parse("32,128,64,4,4,swap,2/sm") == TileConfig(32, 128, 64, 4, 4, swap_ab=True, per_sm=2)
    assert TileConfig.parse("128,128,64,8,3,2/sm") == TileConfig(128, 128, 64, 8, 3, per_sm=2)
    assert TileConfig.parse("32,128,128,4,5,swap").per_sm == 1
    for bad in ("32,128,64,4,4,3/sm", "32,128,64,4,4,x/sm", "32,128,64,4"):
        with pytest.raises(ValueError, match=r"2/sm"):
            TileConfig.parse(bad)
