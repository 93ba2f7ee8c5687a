"""Prints the gin search path under which `t5x_speed/gin/...` resolves.

T5X searches the folder that holds the `t5x` package, so where t5x_speed is
installed beside T5X (a plain `pip install`), `--gin_file=t5x_speed/gin/...`
needs nothing more. Elsewhere (an editable install, another site folder):

  python -m t5x.train \\
    --gin_search_paths="$(python -m t5x_speed.gin_path)" \\
    --gin_file=t5x_speed/gin/models/speed_base_4x3.gin ...
"""

import os

import t5x_speed

GIN_DIR = os.path.join(os.path.dirname(os.path.abspath(t5x_speed.__file__)),
                       'gin')
SEARCH_PATH = os.path.dirname(os.path.dirname(GIN_DIR))

if __name__ == '__main__':
  print(SEARCH_PATH)
