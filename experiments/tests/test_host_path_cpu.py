"""experiments/host_path_cpu.py (the ops' Python host time per call, launch stubbed) keeps working as
the runtime's state changes: it once broke on a removed field and nobody noticed."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_host_path_script_runs_without_a_gpu():
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "host_path_cpu.py"), "16"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("us per call") == 3, p.stdout
