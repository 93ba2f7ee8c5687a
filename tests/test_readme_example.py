"""The README's library example runs as written and prints what it says."""

import contextlib
import io
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'


def test_library_example_prints_tokens_and_speed_statistics():
  blocks = re.findall(r'```python\n(.*?)```', README.read_text(), re.S)
  assert len(blocks) == 1, 'the README has one Python example'
  namespace = {}
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(compile(blocks[0], 'README.md', 'exec'), namespace)  # pylint: disable=exec-used
  out = namespace['out']
  assert np.asarray(out.tokens).shape == (2, 32)
  text = printed.getvalue()
  assert str(np.asarray(out.tokens)) in text
  summary = out.stats.summary()
  assert summary['tokens'] == 64 and summary['steps_per_token'] >= 1
  assert str(summary) in text
