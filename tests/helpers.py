"""Tiny models shared by the tests."""

import dataclasses
import doctest
import fcntl
import functools
import glob
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import network
from t5x_speed.testing import RESIDUAL_OUTPUTS
from t5x_speed.testing import random_params

REPO = pathlib.Path(__file__).resolve().parents[1]


def assert_doctests(*modules, min_examples: int = 1, **testmod_kwargs):
  """Runs each module's docstring examples (`doctest.testmod`, with
  `testmod_kwargs`); fails unless each ran at least `min_examples` and none
  failed (doctest prints the failures)."""
  for module in modules:
    result = doctest.testmod(module, **testmod_kwargs)
    if result.attempted < min_examples or result.failed:
      raise AssertionError(
          f'{module.__name__}: {result.failed} of {result.attempted} '
          f'docstring examples failed (at least {min_examples} expected)')


def tiny_config(**overrides) -> network.TransformerConfig:
  kwargs = dict(vocab_size=61, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
                num_unique_layers=2, num_repeats=3, dtype='float32')
  kwargs.update(overrides)
  return network.TransformerConfig(**kwargs)


@functools.lru_cache(maxsize=None)
def tiny_model(**overrides):
  """(module, params) of a randomly initialised tiny model."""
  cfg = tiny_config(**overrides)
  module = network.SpeedTransformer(cfg)
  return module, random_params(module,
                               cfg.num_unique_layers * 7 + cfg.num_repeats)


def random_tokens(seed: int, shape, vocab: int):
  """Token ids in [1, vocab) of `shape`, drawn on the host."""
  return jnp.asarray(np.random.default_rng(seed).integers(1, vocab, shape),
                     jnp.int32)


def is_residual_output(path) -> bool:
  """Whether a parameter tree path leads to a `RESIDUAL_OUTPUTS` kernel."""
  return any(getattr(p, 'key', None) in RESIDUAL_OUTPUTS for p in path)


def random_model(g, r, sharing, seed, vocab_size):
  """(module, params): `tiny_model`'s shape with weights re-drawn per seed.

  For odd seeds the residual branches are amplified so that every layer
  moves the prediction: the exits then disagree on most tokens and SPEED
  flushes almost every step.
  """
  module, params = tiny_model(vocab_size=vocab_size, num_unique_layers=g,
                              num_repeats=r, sharing=sharing)
  # Drawn on the host: a jitted draw of every leaf compiles for seconds.
  gain = 4.0 if seed % 2 else 1.0
  rng = np.random.RandomState(seed)
  flat, tree = jax.tree_util.tree_flatten_with_path(params)
  params = jax.tree.unflatten(tree, [jnp.asarray(
      (x + 0.5 * rng.standard_normal(x.shape) * np.std(x)) *
      (gain if is_residual_output(path) else 1.0), np.float32)
                                     for (path, x) in (
                                         (path, np.asarray(x))
                                         for path, x in flat)])
  return module, params


def train_sentencepiece(directory: str, lines=None, vocab_size: int = 100) -> str:
  """Trains a T5-style SentencePiece model (pad 0, EOS 1, UNK 2, no BOS).

  Args:
    directory: where the text and `spm.model` are written.
    lines: training text; by default translation-like English/German lines.
    vocab_size: the model's vocabulary size.

  Returns:
    The path of the model file.
  """
  import os  # pylint: disable=g-import-not-at-top
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  if lines is None:
    lines = [f'translate English to German: the house number {i} is blue '
             f'und das Haus ist blau {i * 7}' for i in range(300)]
  text = os.path.join(directory, 'spm.txt')
  with open(text, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  prefix = os.path.join(directory, 'spm')
  spm.SentencePieceTrainer.train(
      input=text, model_prefix=prefix, vocab_size=vocab_size, pad_id=0,
      eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
  return prefix + '.model'


@functools.lru_cache(maxsize=None)
def installed_package() -> 'InstalledPackage':
  """t5x_speed built into a wheel and installed apart from the checkout.

  A fresh venv gets the wheel in its site-packages and, through a .pth line,
  this environment's dependencies (a path line: the checkout's editable
  install, itself a .pth hook there, is not run). T5X, where installed, is
  linked in beside the wheel as `pip install` would put it, so T5X's default
  gin search path is the folder that holds t5x_speed/gin. Built once per
  session in $T5X_SPEED_TEST_PACKAGE_DIR (conftest.py), under a file lock
  that the pytest-xdist workers share; once per process without it.
  """
  root = os.environ.get('T5X_SPEED_TEST_PACKAGE_DIR') or tempfile.mkdtemp(
      prefix='t5x_speed_wheel_')
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, 'lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    record = os.path.join(root, 'package.json')
    if not os.path.exists(record):
      package = _build_installed_package(root)
      with open(record, 'w') as f:
        json.dump(dataclasses.asdict(package), f)
    with open(record) as f:
      return InstalledPackage(**json.load(f))


def _build_installed_package(root: str) -> 'InstalledPackage':
  """`installed_package`'s build, into the empty folder `root`."""
  import site  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  dist = os.path.join(root, 'dist')
  subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps',
                  '--no-build-isolation', '-w', dist, str(REPO)],
                 check=True, capture_output=True)
  (wheel,) = glob.glob(os.path.join(dist, 't5x_speed-*.whl'))
  venv = os.path.join(root, 'venv')
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', venv],
                 check=True)
  python = os.path.join(venv, 'bin', 'python')
  site_dir = subprocess.run(
      [python, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
      check=True, capture_output=True, text=True).stdout.strip()
  with open(os.path.join(site_dir, 'dependencies.pth'), 'w') as f:
    f.write('\n'.join(site.getsitepackages()) + '\n')
  t5x = importlib.util.find_spec('t5x')
  if t5x is not None:
    os.symlink(t5x.submodule_search_locations[0],
               os.path.join(site_dir, 't5x'))
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps',
                  '--target', site_dir, wheel], check=True,
                 capture_output=True)
  return InstalledPackage(python=python, site_dir=site_dir, wheel=wheel)


@dataclasses.dataclass(frozen=True)
class InstalledPackage:
  python: str    # the fresh venv's interpreter
  site_dir: str  # where the wheel was installed
  wheel: str     # the built wheel
