"""Tuning knobs (ETDIST_* environment variables): a bad value never breaks `import etdist`, and
the code that reads it raises KnobError naming the variable before anything else happens."""
import pytest

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
    """A knob read when its code first runs (ETDIST_SHARE_GPU at init_mesh, say) names itself in
    the error: a bad value was once int()'s bare ValueError."""
    monkeypatch.setenv("ETDIST_TEST_N", "-2")
    with pytest.raises(knobs.KnobError, match=r"ETDIST_TEST_N='-2': want a positive integer"):
        knobs.now("ETDIST_TEST_N", knobs.positive_int, 64)
    monkeypatch.setenv("ETDIST_TEST_N", "")
    assert knobs.now("ETDIST_TEST_N", knobs.positive_int, 64) == 64


@pytest.mark.parametrize("parse,good,bad", [
    (knobs.positive_int, {"1": 1, "64": 64}, ["0", "-3", "1.5", "x"]),
    (knobs.flag, {"0": False, "1": True}, ["abc", "2", "yes"]),
    (knobs.tile_width, {"16": 16, "256": 256}, ["8", "0", "48", "x", "-16"]),
])
def test_parsers(parse, good, bad):
    for text, want in good.items():
        assert parse(text) == want
    for text in bad:
        with pytest.raises(ValueError):
            parse(text)


def test_every_variable_is_listed_and_read_in_knobs_alone():
    """The package names no ETDIST_* variable that knobs.VARIABLES does not list, and no module but
    knobs reads the environment for one (they were read in seven modules, some straight from os.environ)."""
    import pathlib
    import re
    root = pathlib.Path(knobs.__file__).parent
    named, readers = set(), []
    for path in root.rglob("*.py"):
        src = path.read_text()
        named |= set(re.findall(r"ETDIST_[A-Z0-9_]+", src))
        if path.name != "knobs.py" and re.search(r"(environ|getenv)[^\n]*ETDIST_", src):
            readers.append(str(path.relative_to(root)))
    assert named <= set(knobs.VARIABLES), named - set(knobs.VARIABLES)
    assert not readers, readers
    assert len(knobs.VARIABLES) <= 5
