"""The test launcher's two kinds of rank: forked from the preloaded server, or (for ranks that use CUDA) fresh
interpreters that inherit none of the server's imports."""

from forked_ranks import run_ranks

SCRIPT = """
import os, sys
print(os.environ["RANK"], "frozen_preload" in sys.modules, "deepspeed" in sys.modules)
"""


def test_fresh_ranks_inherit_none_of_the_servers_imports(tmp_path):
    script = tmp_path / "which.py"
    script.write_text(SCRIPT)
    fresh = run_ranks(script, nproc=2, timeout=120, fork=False)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert sorted(line for line in fresh.stdout.splitlines() if line[:1].isdigit()) == ["0 False False",
                                                                                       "1 False False"]
    forked = run_ranks(script, nproc=2, timeout=120)
    assert forked.returncode == 0, forked.stderr[-2000:]
    assert sorted(line for line in forked.stdout.splitlines() if line[:1].isdigit()) == ["0 True True", "1 True True"]
