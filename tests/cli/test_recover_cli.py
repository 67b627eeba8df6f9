"""`statediff recover`: the parts directory of a killed recording becomes one partial trace."""

import os
import subprocess
import sys
import textwrap

from click.testing import CliRunner

from statediff.cli import cli
from statediff.trace import open_trace


def test_recover_a_killed_recording(tmp_path):
    trace = tmp_path / "t.h5"
    child = textwrap.dedent(f"""
        import os, numpy as np
        from statediff.trace import TraceWriter
        w = TraceWriter({str(trace)!r}, {{"engine": "synthetic"}})
        w.begin_request(0, "a", [1, 2, 3])
        for pos in (32, 64):
            w.add(np.full((2, 3), pos, np.float32), request=0, position=pos, layer=0,
                  kind="gdn.ssm_state", role="checkpoint", module="m", dtype="float32")
            w.end_step()
        w._stop_threads()  # let the writer thread finish the handed-over steps, then die unclosed
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", child], check=True, env=os.environ)
    assert not trace.exists() and (tmp_path / "t.h5.parts").is_dir()
    out = tmp_path / "r.h5"
    res = CliRunner().invoke(cli, ["recover", str(tmp_path / "t.h5.parts"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == f"recovered 2 tensors from 2 completed steps into {out} (partial)"
    with open_trace(out) as t:
        assert t.partial and [e.position for e in t.entries] == [32, 64]
    # an output inside the parts directory would replace the data it recovers from, --overwrite or not
    inside = tmp_path / "t.h5.parts" / "data.h5"
    before = inside.read_bytes()
    res = CliRunner().invoke(cli, ["recover", str(tmp_path / "t.h5.parts"), "-o", str(inside), "--overwrite"])
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        f"statediff: error: {inside} is inside {tmp_path / 't.h5.parts'}, the parts directory being recovered: "
        "write it elsewhere"]
    assert inside.read_bytes() == before


def test_recover_refuses_what_is_not_a_parts_directory(tmp_path):
    res = CliRunner().invoke(cli, ["recover", str(tmp_path / "nope"), "-o", str(tmp_path / "x.h5")])
    assert res.exit_code == 2
    assert "is not a directory (expected <trace>.parts)" in res.output
