"""pool_pages: the small-object allocator's empty pools go back to the OS, and what
the allocator hands out afterwards is sound. Each check runs in a fresh interpreter:
the arena hook is process-wide, and RSS is only meaningful in a process of its own."""
import subprocess
import sys
import textwrap

import pytest

import distributed_core
from distributed_server.diagnostics import heap_trim

if sys.platform != "linux":
    pytest.skip("pool_pages gives pages back on Linux only", allow_module_level=True)
if heap_trim.pool_pages is None:
    if distributed_core.COMPILED:
        pytest.fail("the compiled install lacks distributed_server.diagnostics.pool_pages")
    pytest.skip("the interpreted install has no pool_pages", allow_module_level=True)

#: Builds a quarter of a GiB of small objects, keeps one in 2,000 of them (enough to
#: keep nearly every arena), frees the rest, then reuses the memory three times.
SCRIPT = textwrap.dedent("""
    import gc, random, sys
    from distributed_server.diagnostics import heap_trim

    def rss_mib():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024

    assert heap_trim.track_arenas() and heap_trim.track_arenas()  # idempotent
    rows = [(str(i), [i], {"i": i}) for i in range(600_000)]
    kept = rows[::2_000]
    arenas = heap_trim.pool_pages.arenas()[0]
    del rows
    gc.collect()
    before = rss_mib()
    step, done = heap_trim.release_empty_pools(1_000)  # a step: 1,000 pools
    assert 0 < step <= 1_000 * 12_288 and not done, (step, done)
    released, done = heap_trim.release_empty_pools()
    after = rss_mib()
    released += step
    print("arenas", arenas, "released MiB", released / 2**20, "rss", before, after)
    assert arenas > 100 and done, (arenas, done)
    assert released > 50 * 2**20, released
    assert before - after > 0.8 * released / 2**20, (before, after, released)
    assert heap_trim.release_empty_pools() == (0, True)  # nothing new to give back
    for round in range(3):  # the pools given back are taken again, of other sizes too
        size = 3 + round
        rows = [(str(i),) * size + ({"i": i, "s": str(i)},) for i in range(400_000)]
        random.shuffle(rows)
        for row in rows:
            i = row[-1]["i"]
            assert row[:size] == (str(i),) * size and row[-1]["s"] == str(i)
        del rows
        gc.collect()
        assert heap_trim.release_empty_pools()[0] > 0
    assert all(row[0] == str(row[1][0]) == str(row[2]["i"]) for row in kept)
    print("ok")
""")


@pytest.mark.parametrize("allocator", ["pymalloc", "pymalloc_debug"])
def test_empty_pools_go_back_to_the_os_and_the_memory_is_reused_soundly(allocator):
    """Under the debug allocator, a block damaged by a dropped page would be reported
    (it checks the guard bytes around every block it frees)."""
    env = {"PYTHONMALLOC": allocator, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.endswith("ok\n"), done.stdout


def test_without_pymalloc_nothing_is_known_and_nothing_released():
    code = ("from distributed_server.diagnostics import heap_trim as h\n"
            "h.track_arenas(); x = [str(i) for i in range(200_000)]; del x\n"
            "print(h.pool_pages.arenas(), h.release_empty_pools())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONMALLOC": "malloc", "PATH": "/usr/bin:/bin"},
                          timeout=60, check=False)
    assert done.stdout.split("\n")[0] == "(0, 0) (0, True)", done.stdout + done.stderr
