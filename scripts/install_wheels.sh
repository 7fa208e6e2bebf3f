# Sourced on a GPU machine (no package registry) from a checkout's root, before its GPU scripts and tests:
#
#   source scripts/install_wheels.sh
#
# installs the wheels carried in .whl/ (fetched where a registry is reachable: python3 -m pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 ... -d .whl NAME==VERSION) that the
# machine lacks, or has in a version another carried wheel does not accept, into /tmp/site, puts that on
# PYTHONPATH (the machine's own copies are not shadowed otherwise), then the checkout itself (pip install -e:
# nothing is downloaded). A second run installs no wheel. Returns 1 (the caller's `|| exit 1`) on failure.
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
wheels=$(python3 - <<'PY'
"""The carried wheels to install: those whose distribution the machine lacks, then (transitively) those
whose machine copy a wheel being installed does not accept."""
import importlib.metadata as md
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

carried = {}
for path in sorted(Path(".whl").glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(path.name)
    carried[name] = (version, path)


def installed(name):
    try:
        return Version(md.version(name))
    except md.PackageNotFoundError:
        return None


def requirements(path):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in headers.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


need = [name for name in carried if installed(name) is None]
for name in need:  # grows while it is walked
    for req in requirements(carried[name][1]):
        dep = canonicalize_name(req.name)
        have = carried[dep][0] if dep in need else installed(dep)
        if have is not None and req.specifier.contains(have, prereleases=True):
            continue
        if dep not in carried or not req.specifier.contains(carried[dep][0], prereleases=True):
            sys.exit(f"{name} needs {req}: the machine has {have or 'none'}, and .whl/ carries "
                     f"{carried[dep][0] if dep in carried else 'none'}")
        need.append(dep)
print(" ".join(str(carried[name][1]) for name in need))
PY
) || { echo "install_wheels: the carried wheels do not fit this machine (above)"; return 1; }
if [ -n "$wheels" ]; then
    echo "== installing into /tmp/site: $wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
        || { echo "install_wheels: installing the carried wheels failed"; return 1; }
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || { echo "install_wheels: pip install -e . failed"; return 1; }

