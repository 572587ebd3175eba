"""The wheel: it builds without a warning, installs into a fresh virtual
environment, and works from there with the source tree out of reach.

The build runs on a copy of the source (setuptools writes `build/` and
`*.egg-info` next to what it builds). The virtual environment borrows this
one's installed dependencies without the network: its site-packages gets a
`.pth` file holding this environment's site-packages as a plain path line (so
that directory's own `.pth` files, the editable install's finder among them,
are not run), then pip installs the wheel into it with `--ignore-installed`
(the editable install it can see stays as it is). Everything there runs from
a temporary directory, so neither the source tree nor the editable install
can be what is imported.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "tokamax_gdn"
# What the build reads: the package, its metadata and the presets that
# `tokamax_gdn/data/models` links to.
SOURCES = ("pyproject.toml", "setup.cfg", "README.md", "LICENSE", PACKAGE, "configs")

# Run inside the virtual environment: what was imported from where, and what
# the installed package finds through its own APIs.
_PROBE = """
import json, pathlib, sys
import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.autotuning import cache
from tokamax_gdn.layers import presets
from tokamax_gdn.models.config import ModelConfig

tiny = tokamax_gdn.layers.load_preset("qwen3.5-tiny")
micro = ModelConfig.load("qwen3.5-micro")
xla_gdn = registry.get("gated_delta_rule", "xla")
# tokamax's own lookup (what a layer's call does) hits the shipped data:
# the GDN calls `tokamax-gdn autotune` tunes, at a shape it shipped for CPU.
import jax.numpy as jnp
from tokamax_gdn.benchmarks import autotune as tune
from tokamax_gdn.benchmarks import workload
shape = workload.LayerShape(b=1, t=8192, hk=2, hv=4, k=128, v=128, dtype=jnp.bfloat16)
lookups = []
for label, ba in tune.bound_args("gated_delta_rule", "xla", shape):
  data = ba.op.get_autotuning_cache("cpu").get(ba.autotuning_cache_key)
  lookups.append([label, None if data is None else data.fastest_config.chunk_size])
print(json.dumps(dict(
    lookups=lookups,
    package=tokamax_gdn.__file__,
    sys_path=sys.path,
    presets=presets.list_presets(),
    preset_file=str(presets.preset_file("qwen3.5-tiny")),
    tiny=dict(hidden_size=tiny.hidden_size, num_v_heads=tiny.num_v_heads,
              head_k_dim=tiny.head_k_dim),
    micro_layers=micro.num_layers,
    shipped=[str(p) for p in cache.shipped_files()],
    cpu_xla_entries=len(cache.load_shipped(xla_gdn, "cpu")),
)))
"""


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
  assert result.returncode == 0, (
      f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
  return result


def _clean_env(**extra) -> dict[str, str]:
  """This process's environment without what would point Python or the
  package elsewhere."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("PYTHON", "TOKAMAX_GDN_", "VIRTUAL_ENV", "PIP_"))}
  return dict(env, PYTHONNOUSERSITE="1", JAX_PLATFORMS="cpu", **extra)


def _relative_files(root: pathlib.Path, patterns) -> set[str]:
  return {str(p.relative_to(root)) for pattern in patterns for p in root.glob(pattern)
          if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[pathlib.Path, str]:
  """(the built wheel, the build's output)."""
  tmp = tmp_path_factory.mktemp("wheel")
  src = tmp / "src"
  for name in SOURCES:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, src / name, symlinks=True,
                      ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
      src.mkdir(exist_ok=True)
      shutil.copy2(ROOT / name, src / name)
  # -v: pip shows the build backend's output, setuptools' warnings included.
  build = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                "--no-index", "--no-cache-dir", "-w", str(tmp / "dist"), str(src)],
               cwd=tmp, env=_clean_env())
  (whl,) = (tmp / "dist").glob(f"{PACKAGE}-*.whl")
  return whl, build.stdout + build.stderr


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> pathlib.Path:
  """A fresh virtual environment with the wheel installed (not editable)."""
  path = tmp_path_factory.mktemp("venv") / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(path)], env=_clean_env())
  python = path / "bin" / "python"
  site = pathlib.Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                            "['purelib'])"], env=_clean_env()).stdout.strip())
  (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
        "--no-cache-dir", "--disable-pip-version-check", str(wheel[0])],
       cwd=path.parent, env=_clean_env())
  return path


@pytest.mark.slow
def test_wheel_builds_without_warnings(wheel):
  _, output = wheel
  warnings = [line for line in output.splitlines()
              if re.search(r"warning", line, re.IGNORECASE)]
  assert not warnings, "\n".join(warnings)


@pytest.mark.slow
def test_wheel_metadata(wheel):
  """What PyPI shows and what tools read (as jax's and tokamax's do)."""
  import zipfile  # pylint: disable=g-import-not-at-top
  whl, _ = wheel
  with zipfile.ZipFile(whl) as z:
    names = z.namelist()
    info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/METADATA"))
    metadata = z.read(f"{info}/METADATA").decode()
    license_text = z.read(f"{info}/licenses/LICENSE").decode()
  headers = metadata.split("\n\n", 1)[0]
  fields = {}
  for line in headers.splitlines():
    key, _, value = line.partition(": ")
    fields.setdefault(key, []).append(value)
  assert fields["Summary"][0].startswith("Gated Delta Net"), fields["Summary"]
  assert fields["License-Expression"] == ["Apache-2.0"]
  assert fields["License-File"] == ["LICENSE"]
  assert license_text == (ROOT / "LICENSE").read_text()
  assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
  assert any(url.endswith("https://github.com/openxla/tokamax") for url in fields["Project-URL"])
  classifiers = set(fields["Classifier"])
  assert "Programming Language :: Python :: 3.12" in classifiers
  assert any(c.startswith("Development Status ::") for c in classifiers)
  assert any(c.startswith("Topic ::") for c in classifiers)
  assert fields["Description-Content-Type"] == ["text/markdown"]
  assert metadata.split("\n\n", 1)[1].strip()   # the README as the long description
  # Every module and data file of the source tree, and nothing of the tests.
  wanted = _relative_files(ROOT, [f"{PACKAGE}/**/*.py", f"{PACKAGE}/data/**/*.json",
                                  f"{PACKAGE}/data/**/*.yml"])
  shipped = {n for n in names if not n.startswith(info)}
  assert wanted <= shipped, sorted(wanted - shipped)
  assert not any(n.startswith(("tests/", "configs/")) for n in names)


@pytest.mark.slow
def test_installed_package_works_from_its_own_location(venv):
  """Imported from the virtual environment (not the source tree nor the
  editable install); its presets and shipped autotuning data are found
  inside it; the `tokamax-gdn` console script runs."""
  python = venv / "bin" / "python"
  probe = _run([str(python), "-c", _PROBE], cwd=venv.parent, env=_clean_env())
  facts = json.loads(probe.stdout.strip().splitlines()[-1])
  installed = venv.resolve()
  package = pathlib.Path(facts["package"]).resolve()
  assert package.is_relative_to(installed), (package, facts["sys_path"])
  assert not package.is_relative_to(ROOT), package
  pkg_dir = package.parent
  source_presets = sorted(p.stem for p in (ROOT / "configs" / "models").glob("*.yml"))
  assert facts["presets"] == source_presets
  assert pathlib.Path(facts["preset_file"]).resolve().is_relative_to(pkg_dir / "data" / "models")
  # The presets' values, read from the source tree's files.
  tiny = yaml.safe_load((ROOT / "configs" / "models" / "qwen3.5-tiny.yml").read_text())
  micro = yaml.safe_load((ROOT / "configs" / "models" / "qwen3.5-micro.yml").read_text())
  assert facts["tiny"] == {k: tiny[k] for k in facts["tiny"]}
  assert facts["micro_layers"] == micro["model"]["num_layers"]
  source_data = ROOT / PACKAGE / "data" / "autotuning"
  shipped = [pathlib.Path(p).resolve() for p in facts["shipped"]]
  assert shipped and all(p.is_relative_to(pkg_dir / "data" / "autotuning") for p in shipped)
  assert sorted(str(p.relative_to(pkg_dir / "data" / "autotuning")) for p in shipped) == (
      sorted(str(p.relative_to(source_data)) for p in source_data.glob("*/*.json")))
  # Entries of the shipped file, counted from the source tree's copy.
  source_entries = json.loads((source_data / "cpu" / "xla_gated_delta_rule.json").read_text())
  assert facts["cpu_xla_entries"] == len(source_entries) > 0
  # The installed package's lookups hit, with the fastest configs the source
  # tree's data gives for the same keys.
  from tokamax_gdn import autotuning  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import autotune as tune  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import workload  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  autotuning.reload()
  shape = workload.LayerShape(b=1, t=8192, hk=2, hv=4, k=128, v=128, dtype=jnp.bfloat16)
  want = [[label, ba.op.get_autotuning_cache("cpu")[ba.autotuning_cache_key]
           .fastest_config.chunk_size]
          for label, ba in tune.bound_args("gated_delta_rule", "xla", shape)]
  assert facts["lookups"] == want
  assert [label for label, _ in want] == ["fwd", "fwd (in grad)", "vjp"]

  script = venv / "bin" / "tokamax-gdn"
  assert script.read_text().startswith(f"#!{python}"), script.read_text()[:200]
  listed = _run([str(script), "list"], cwd=venv.parent, env=_clean_env()).stdout
  for op_name in ("gated_delta_rule", "causal_conv1d", "gmm", "tgmm",
                  "causal_conv1d_gated_delta_rule"):
    assert re.search(rf"^{op_name}\s+xla\s", listed, re.MULTILINE), listed
