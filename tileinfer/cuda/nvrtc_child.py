"""One NVRTC compile in a process of its own, for compiler.compile_all.

Reads a JSON job from stdin: {"name", "source", "headers": {name: text}, "options": [...]}. Writes the cubin
to stdout and, to stderr, the seconds NVRTC's compile took (the rest of the child's time is its
interpreter's start, its imports and libnvrtc's load) with the process's own CPU seconds and page faults
(compiler.CHILD_REPORT) and exits 0; when NVRTC rejects the source, writes NVRTC's log and exits with
compiler.COMPILE_FAILED (the parent raises the CompileError, with the options and the source it holds);
anything else fails with a traceback on stderr.

Run as a script (`python -P nvrtc_child.py`), not as `-m tileinfer.cuda.nvrtc_child`: the package's
__init__ files import the whole engine (seconds, for every child), and the compile needs only
compiler.py and driver.py, which import nothing else of it. So the two packages are entered here as
bare namespaces, without running their __init__ files.
"""
import json
import resource
import sys
import time
import types
from pathlib import Path


def _compiler():
    here = Path(__file__).resolve().parent
    for name, path in (("tileinfer", here.parent), ("tileinfer.cuda", here)):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    from tileinfer.cuda import compiler
    return compiler


def main() -> int:
    compiler = _compiler()
    job = json.loads(sys.stdin.buffer.read())
    compiler.nvrtc.nvrtcVersion()  # loads libnvrtc (at its first call), so that NVRTC's seconds are the compile's
    start = time.perf_counter()
    try:
        cubin = compiler._nvrtc_compile(job["name"], job["source"], job["headers"], job["options"])[0]
    except compiler.CompileError as e:
        sys.stdout.buffer.write(e.log.encode())
        return compiler.COMPILE_FAILED
    nvrtc_seconds = time.perf_counter() - start
    use = resource.getrusage(resource.RUSAGE_SELF)
    sys.stderr.write(f"nvrtc_seconds {nvrtc_seconds:.4f} user {use.ru_utime:.3f} system {use.ru_stime:.3f} "
                     f"faults {use.ru_minflt} {use.ru_majflt}\n")
    sys.stdout.buffer.write(cubin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
