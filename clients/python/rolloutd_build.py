"""In-tree PEP 517 build backend (standard library only) for rolloutd-client.

Why not setuptools: a setuptools build needs setuptools and `wheel` in pip's isolated build
environment, which pip downloads; on a machine without an index (CI, a training cluster) that fails,
and `--no-build-isolation` needs them installed (setuptools < 70.1 cannot build a wheel without
`wheel`). This backend has no build requirements, so `pip install ./clients/python` works offline.
It builds a pure-Python py3-none-any wheel of the `rolloutd_client` package, an sdist, and an
editable wheel (PEP 660, a .pth file) from the [project] table of pyproject.toml.
"""
import base64
import hashlib
import io
import os
import pathlib
import re
import tarfile
import zipfile

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE = "rolloutd_client"


def _toml_project():
    """The [project] table (tomllib on 3.11+, else a parser for the subset pyproject.toml uses:
    strings, lists of strings, inline {text = ...} tables, [project.optional-dependencies])."""
    text = (HERE / "pyproject.toml").read_text()
    try:
        import tomllib
        return tomllib.loads(text)["project"]
    except ImportError:
        pass
    project, table = {}, None
    lines = iter(text.splitlines())
    for line in lines:
        line = line.split("#", 1)[0].strip() if not line.strip().startswith('"') else line.strip()
        if not line:
            continue
        m = re.fullmatch(r"\[([^\]]+)\]", line)
        if m:
            name = m.group(1)
            table = project if name == "project" else (
                project.setdefault("optional-dependencies", {}) if name == "project.optional-dependencies" else None)
            continue
        if table is None or "=" not in line:
            continue
        key, val = (s.strip() for s in line.split("=", 1))
        while val.startswith("[") and not val.rstrip().endswith("]"):
            val += " " + next(lines).split("#", 1)[0].strip()
        table[key] = _value(val)
    return project


def _value(val):
    if val.startswith('"'):
        return val[1:val.index('"', 1)]
    if val.startswith("["):
        return re.findall(r'"([^"]*)"', val)
    if val.startswith("{"):
        return dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', val))
    return val


def _metadata():
    p = _toml_project()
    lines = ["Metadata-Version: 2.1", f"Name: {p['name']}", f"Version: {p['version']}",
             f"Summary: {p.get('description', '')}"]
    if "requires-python" in p:
        lines.append(f"Requires-Python: {p['requires-python']}")
    lic = p.get("license")
    if isinstance(lic, dict) and "text" in lic:
        lines.append(f"License: {lic['text']}")
    for d in p.get("dependencies", []):
        lines.append(f"Requires-Dist: {d}")
    for extra, deps in p.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for d in deps:
            lines.append(f'Requires-Dist: {d}; extra == "{extra}"')
    readme = HERE / "README.md"
    body = ""
    if readme.is_file():
        lines.append("Description-Content-Type: text/markdown")
        body = "\n" + readme.read_text()
    return p["name"], p["version"], "\n".join(lines) + "\n" + body


def _dist(name):
    return re.sub(r"[-_.]+", "_", name)


def _sources():
    for f in sorted((HERE / PACKAGE).rglob("*.py")):
        yield f.relative_to(HERE).as_posix(), f.read_bytes()


def _write_wheel(wheel_directory, files):
    name, version, meta = _metadata()
    dist = f"{_dist(name)}-{version}"
    info = f"{dist}.dist-info"
    files = list(files) + [
        (f"{info}/METADATA", meta.encode()),
        (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: rolloutd_build\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
        (f"{info}/top_level.txt", f"{PACKAGE}\n".encode()),
    ]
    record = []
    for path, data in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode()))
    fname = f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, fname), "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files:
            zi = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    return fname


# ---------------------------------------------------------------- PEP 517 / 660 hooks

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, _sources())


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, [(f"__editable__.{PACKAGE}.pth", (str(HERE) + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    name, version, meta = _metadata()
    base = f"{_dist(name)}-{version}"
    fname = f"{base}.tar.gz"
    extra = [("pyproject.toml", (HERE / "pyproject.toml").read_bytes()),
             ("rolloutd_build.py", (HERE / "rolloutd_build.py").read_bytes()), ("PKG-INFO", meta.encode())]
    if (HERE / "README.md").is_file():
        extra.append(("README.md", (HERE / "README.md").read_bytes()))
    with tarfile.open(os.path.join(sdist_directory, fname), "w:gz", format=tarfile.PAX_FORMAT) as t:
        for path, data in extra + list(_sources()):
            ti = tarfile.TarInfo(f"{base}/{path}")
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 1577836800
            t.addfile(ti, io.BytesIO(data))
    return fname
