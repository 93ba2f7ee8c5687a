"""`python -m t5x_speed.cpu`: builds the CPU kernels now (or finds them).

Never fails: without a compiler, or where the build fails, it says why and
that XLA's ops will be used, and exits 0 (everything works without the
kernels; `make kernel` runs this).
"""

import sys

from t5x_speed.cpu import build


def main(argv) -> int:
  if argv[1:]:
    print('usage: python -m t5x_speed.cpu', file=sys.stderr)
    return 2
  try:
    path = build.build(verbose=True)
  except (RuntimeError, OSError) as e:
    print(f't5x_speed: CPU kernels not built, XLA\'s ops will be used: {e}',
          file=sys.stderr)
    return 0
  print(f't5x_speed: CPU kernels at {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
