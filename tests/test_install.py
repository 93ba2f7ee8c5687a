"""The package as a user installs it: a wheel, apart from the checkout.

The wheel must carry the gin configs and the kernel's source, and nothing of
the tools or tests; installed into a fresh venv and run from another
directory, every library module (the tasks included) imports without the
checkout, and so without the tools. T5X's stock binaries run from the same
installed package in test_t5x_binaries.py.
"""

import importlib.util
import os
import subprocess
import tempfile
import zipfile

from absl.testing import absltest

import helpers

REPO = helpers.REPO
LIBRARY = REPO / 't5x_speed'


def _library_modules():
  """Dotted names of the library's modules, from the checkout's files."""
  names = []
  for path in sorted(LIBRARY.rglob('*.py')):
    parts = path.relative_to(REPO).with_suffix('').parts
    names.append('.'.join(parts[:-1] if parts[-1] == '__init__' else parts))
  return names


class InstalledPackageTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.package = helpers.installed_package()

  def _run(self, code: str) -> str:
    proc = subprocess.run(
        [self.package.python, '-c', code], cwd=tempfile.mkdtemp(),
        env=dict(os.environ, PYTHONPATH='', JAX_PLATFORMS='cpu'),
        capture_output=True, text=True, timeout=600)
    self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
    return proc.stdout

  def test_wheel_ships_gin_files_and_kernel_source_only(self):
    with zipfile.ZipFile(self.package.wheel) as wheel:
      names = set(wheel.namelist())
    gin_files = {str(p.relative_to(REPO))
                 for p in (LIBRARY / 'gin').rglob('*.gin')}
    self.assertGreater(len(gin_files), 20)
    self.assertEmpty(gin_files - names)
    sources = {str(p.relative_to(REPO))
               for p in (LIBRARY / 'cpu' / 'csrc').iterdir()
               if p.suffix in ('.cc', '.h')}
    self.assertGreaterEqual(len(sources), 5)
    self.assertEmpty(sources - names)
    # Never a built library: it is compiled on the user's machine.
    self.assertEmpty([n for n in names if n.endswith('.so')])
    self.assertIn('t5x_speed/tasks/__init__.py', names)
    self.assertEmpty([n for n in names if n.startswith(('tools/', 'tests/'))])

  def test_star_import_needs_no_t5x(self):
    # The package's names, but for the T5X models (imported on first use).
    out = self._run(
        'import sys\n'
        'sys.modules["t5x"] = None  # as where T5X is not installed\n'
        'from t5x_speed import *\n'
        'print(sorted(k for k in dir() if not k.startswith("_")))\n')
    self.assertIn("'generate'", out)
    self.assertIn("'speed_decode'", out)
    self.assertNotIn('SpeedDecoderOnlyModel', out)

  def test_wheel_declares_ranges_not_pins(self):
    with zipfile.ZipFile(self.package.wheel) as wheel:
      (metadata,) = [n for n in wheel.namelist()
                     if n.endswith('.dist-info/METADATA')]
      requires = [line.split(':', 1)[1].strip()
                  for line in wheel.read(metadata).decode().splitlines()
                  if line.startswith('Requires-Dist:')]
    core = [r for r in requires if 'extra ==' not in r]
    for name in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'clu',
                 'gin-config', 'numpy'):
      self.assertTrue(any(r.split('>')[0].split('=')[0].strip() == name
                          for r in core), (name, core))
    self.assertEmpty([r for r in requires if '==' in r.split(';')[0]])

  def test_every_library_module_imports_apart_from_the_checkout(self):
    modules = [m for m in _library_modules()
               if m != 't5x_speed.models' or importlib.util.find_spec('t5x')]
    out = self._run(
        'import importlib, sys\n'
        f'for name in {modules!r}:\n'
        '  importlib.import_module(name)\n'
        'import t5x_speed\n'
        'from gin import resource_reader\n'
        'assert not any(m == "tools" or m.startswith("tools.") '
        'for m in sys.modules), "a library module imported the tools"\n'
        'assert importlib.util.find_spec("tools") is None\n'
        'print(t5x_speed.__file__)\n'
        'print(resource_reader._parse_config_path(\n'
        '    "t5x_speed/gin/models/decoder_only/__init__.gin"))\n'
        'import seqio\n'
        'print(len(seqio.TaskRegistry.names()))\n')
    module_file, gin_file, tasks = out.split()
    self.assertTrue(module_file.startswith(self.package.site_dir), module_file)
    # gin resolves `t5x_speed/gin/...` through the installed package, from
    # any working directory and with no search path.
    self.assertEqual(gin_file, os.path.join(
        self.package.site_dir,
        't5x_speed/gin/models/decoder_only/__init__.gin'))
    self.assertTrue(os.path.isfile(gin_file))
    self.assertGreater(int(tasks), 5)  # `t5x_speed.tasks` registered its tasks


class LibraryIsolationTest(absltest.TestCase):

  def test_library_sources_import_no_tool(self):
    offenders = []
    for path in LIBRARY.rglob('*.py'):
      for number, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split()
        if words[:1] in (['import'], ['from']) and len(words) > 1 and (
            words[1] == 'tools' or words[1].startswith('tools.')):
          offenders.append(f'{path.relative_to(REPO)}:{number}: {line}')
    self.assertEmpty(offenders)


if __name__ == '__main__':
  absltest.main()
