"""`parity diff` as a test assertion (pytest or any test runner):

    from parity_trace.testing import assert_trace_matches

    def test_my_engine_matches_llama_cpp(tmp_path):
        run_my_engine(out=tmp_path / "trace")                  # writes a trace (TraceWriter)
        assert_trace_matches("golden/mine", tmp_path / "trace")

Exit 0 of `parity diff` passes (the report is returned); exit 1 raises AssertionError carrying
parity's report: the verdict and the named cause of the first divergence; exit 2 (a trace that
cannot be read, a model mismatch, a bad argument) raises ParityError with parity's error.

The `parity` binary is the one installed with this package (pip puts it beside the Python in
the environment's bin/ or Scripts/), else `parity` on PATH; PARITY_BIN or `parity=` override it.
"""
import os
import shutil
import subprocess
import sys
import sysconfig

__all__ = ["ParityError", "assert_trace_matches", "find_parity", "run_diff"]

_EXE = "parity.exe" if os.name == "nt" else "parity"


class ParityError(RuntimeError):
    """parity could not be found, could not run, or could not compare (exit 2)."""


def _installed_script():
    """The `parity` this package's distribution installed (its RECORD), if any."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        files = distribution("parity-trace").files or []
    except PackageNotFoundError:
        return None
    for f in files:
        if f.name == _EXE and f.parent.name in ("bin", "Scripts"):
            p = os.path.abspath(str(f.locate()))
            if os.path.isfile(p):
                return p
    return None


def find_parity():
    """The parity executable: $PARITY_BIN, else the one installed with this package, else one
    in this environment's scripts folder, else `parity` on PATH. Raises ParityError if none."""
    env = os.environ.get("PARITY_BIN")
    if env:
        return env
    p = _installed_script()
    if p:
        return p
    for scheme in (None, f"{os.name}_user"):
        try:
            d = sysconfig.get_path("scripts", scheme) if scheme else sysconfig.get_path("scripts")
        except KeyError:
            continue
        if d and os.path.isfile(os.path.join(d, _EXE)):
            return os.path.join(d, _EXE)
    p = shutil.which("parity")
    if p:
        return p
    raise ParityError("the parity binary was not found: `pip install parity-trace` installs it "
                      f"beside {sys.executable}; or put parity on PATH, or set PARITY_BIN")


def run_diff(golden, trace, *args, parity=None, timeout=None):
    """Run `parity diff GOLDEN TRACE ARGS...`; returns the CompletedProcess (text)."""
    exe = os.fspath(parity) if parity else find_parity()
    cmd = [exe, "diff", os.fspath(golden), os.fspath(trace), *[os.fspath(a) for a in args]]
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
    except OSError as e:
        raise ParityError(f"cannot run {exe}: {e}") from e


def assert_trace_matches(golden, trace, *args, parity=None, timeout=None):
    """Assert that `parity diff GOLDEN TRACE` says parity. Extra args go to `parity diff` (e.g.
    "--model", "m.gguf" or "--strict"). Returns parity's report on success; raises
    AssertionError with the report — its verdict (the first divergence and its named cause)
    first — on a divergence, ParityError when parity could not compare (exit 2) or run."""
    __tracebackhide__ = True  # pytest: show the caller's line, not this helper's
    p = run_diff(golden, trace, *args, parity=parity, timeout=timeout)
    cmd = f"parity diff {os.fspath(golden)} {os.fspath(trace)}"
    if p.returncode == 0:
        return p.stdout
    if p.returncode == 1:
        report = p.stdout.rstrip()
        at = report.find("== verdict")
        if at > 0:  # the verdict first, then the tables and judging that led to it
            report = f"{report[at:]}\n\n{report[:at].rstrip()}"
        err = f"\n{p.stderr.rstrip()}" if p.stderr.strip() else ""
        raise AssertionError(f"{cmd}: the trace does not match (exit 1)\n\n{report}{err}")
    what = p.stderr.strip() or p.stdout.strip() or "(no output)"
    raise ParityError(f"{cmd} could not compare (exit {p.returncode}):\n{what}")
