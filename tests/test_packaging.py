"""The YAML rule tables ship inside the wheel and are found from an installed copy."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_rules_and_finds_them(tmp_path):
    """A built wheel holds hpfun/_rules/*.yaml and, installed elsewhere, loads them from there."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    wheel = next(tmp_path.glob("hpfun-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n for n in names if n.startswith("hpfun/_rules/"))
    assert {Path(n).name for n in shipped} >= {p.name for p in (ROOT / "rules").glob("*.yaml")} | {"README.md"}
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    probe = "import hpfun.rules as r; print(r.builtin_rules_dir()); print(len(r.REGISTRY.ops()))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")},
                         check=True, capture_output=True, text=True).stdout.split()
    assert out[0] == str(tmp_path / "site" / "hpfun" / "_rules")
    assert int(out[1]) > 80
