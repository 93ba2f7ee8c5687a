"""Test session setup and the rules on skipped tests.

Tests that need T5X skip where it is absent (it is not on PyPI). With
T5X_SPEED_REQUIRE_ALL_TESTS=1 (`make test T5X_WHEELS=...`, as CI runs it) a
skipped test fails the run instead, so CI cannot pass without the T5X tests.
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest

import sharding

# Four host devices (the partitioning tests' 2 x 2 mesh); must precede the
# first `import jax` of the session.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=4').strip()
# Many tests, and the T5X binaries they start (which inherit the
# environment), compile the same programs: JAX's persistent cache, fresh for
# each session so that no run reuses another's executables, compiles each
# once. JAX stores only compiles over a second by default; here it stores
# every one, down to the single ops that eager code (T5X's initialisation in
# each binary, the tests' own array arithmetic) compiles one at a time:
# thousands, each read back faster than compiled.
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(
      prefix='t5x_speed_jax_cache_')
  atexit.register(shutil.rmtree, os.environ['JAX_COMPILATION_CACHE_DIR'],
                  ignore_errors=True)

# The package built into a wheel and installed apart from the checkout
# (`helpers.installed_package`): built once per session, under a lock, for
# every pytest-xdist worker (two concurrent `pip wheel` runs of one source
# tree collide in its build directory).
if 'T5X_SPEED_TEST_PACKAGE_DIR' not in os.environ:
  os.environ['T5X_SPEED_TEST_PACKAGE_DIR'] = tempfile.mkdtemp(
      prefix='t5x_speed_wheel_')
  atexit.register(shutil.rmtree, os.environ['T5X_SPEED_TEST_PACKAGE_DIR'],
                  ignore_errors=True)

REQUIRE_ALL = os.environ.get('T5X_SPEED_REQUIRE_ALL_TESTS') == '1'
HAS_T5X = importlib.util.find_spec('t5x') is not None
T5X_HINT = ('T5X tests skipped: T5X is not installed. Install it per '
            'https://github.com/google-research/t5x (or run `make test '
            'T5X_WHEELS=<folder of t5x wheels>`) to run them.')


def pytest_addoption(parser):
  parser.addoption(
      '--shard', default=None, metavar='K/N',
      help='run the K-th of N disjoint parts of the suite (tests/sharding.py)')


def pytest_configure(config):
  if config.getoption('shard'):
    try:
      sharding.parse_shard(config.getoption('shard'))
    except ValueError as e:
      raise pytest.UsageError(str(e)) from None


def pytest_collection_modifyitems(config, items):
  """Slowest modules first (T5X binaries, the tools' end-to-end runs, the
  kernel's narrower builds, ...), so that with pytest-xdist (`make test`)
  each worker takes the next longest when it is free and neither is left
  running a long one alone at the end; with --shard, this shard's alone."""
  items.sort(key=lambda item: -sharding.MODULE_SECONDS.get(item.path.name, 0))
  if config.getoption('shard'):
    shard, num_shards = sharding.parse_shard(config.getoption('shard'))
    shards = sharding.assign([item.path.name for item in items], num_shards)
    dropped = [item for item in items if shards[item.path.name] != shard]
    if dropped:
      config.hook.pytest_deselected(items=dropped)
      items[:] = [item for item in items if shards[item.path.name] == shard]


def pytest_sessionfinish(session, exitstatus):
  reporter = session.config.pluginmanager.get_plugin('terminalreporter')
  skipped = len(reporter.stats.get('skipped', [])) if reporter else 0
  if REQUIRE_ALL and skipped:
    session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
  skipped = terminalreporter.stats.get('skipped', [])
  if REQUIRE_ALL and skipped:
    terminalreporter.write_line(
        f'FAILED: {len(skipped)} test(s) skipped, but '
        'T5X_SPEED_REQUIRE_ALL_TESTS=1 requires every test to run:', red=True)
    for report in skipped:
      terminalreporter.write_line(f'  {report.nodeid}: {report.longrepr}')
  elif not HAS_T5X:
    terminalreporter.write_line(T5X_HINT, yellow=True)
