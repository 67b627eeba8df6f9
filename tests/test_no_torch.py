"""statediff (the offline side) never imports torch or vllm, even through a compare."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, tempfile
sys.path.insert(0, {tests!r})
import statediff, statediff.cli, statediff.diff.compare
from synth import Fault, write_pair
d = tempfile.mkdtemp()
hit, cold = write_pair(d, faults=[Fault("prev_block", 2, 1)])
result = statediff.diff.compare.compare(hit, cold)
assert result.exit_code == 1 and result.first.key == (2, 80, 1, "gdn.ssm_state"), result.to_text()
code = statediff.cli.cli.main(["compare", str(hit), str(cold), "--json"], standalone_mode=False)
assert code == 1, code
code = statediff.cli.cli.main(["--help"], standalone_mode=False)
assert code == 0, code
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm", "statediff_hooks"))
print("LOADED", loaded)
"""


def test_import_and_compare_load_no_torch_or_vllm():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(ROOT / "tests"))],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "LOADED []"
