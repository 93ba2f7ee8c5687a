"""seqio tasks and mixtures of the SPEED paper, registered on import.

`import t5x_speed.tasks` registers, with T5's SentencePiece vocabulary (or the
model file named by the environment variable T5X_SPEED_VOCAB, read now; the
file itself is read on first use, and an unreadable one raises
`VocabularyNotReadableError` saying how to point at a local file):

* tasks 'speed_c4_prefix_lm', 'speed_c4_span_corruption', 'speed_wmt_ende',
  'speed_paracrawl_ende', 'speed_paracrawl_paragraph_ende',
  'speed_cnn_dailymail', 'speed_wikilingua_en';
* mixtures 'speed_pretrain', 'speed_translation_ende', 'speed_summarization',
  'speed_finetune_all';
* the demo task 'speed_demo_numbers' (generated data, byte vocabulary).

`register_translation_tsv_task` registers a translation task over your own
TSV files (e.g. the gettext English-French set of `tools.gettext_data`).

Nothing is downloaded or read on import. `register_tasks` registers them
again with another vocabulary or data locations. The modules hold the
rest: `registry` (task names, output features), `sources`, `vocabularies`,
`preprocessors`, `objectives`, `metrics`, `demo`.
"""

from t5x_speed.tasks.demo import DEMO_TASK
from t5x_speed.tasks.registry import MIXTURES
from t5x_speed.tasks.registry import register_tasks
from t5x_speed.tasks.registry import register_translation_tsv_task
from t5x_speed.tasks.registry import TASKS

__all__ = ['register_tasks', 'register_translation_tsv_task', 'TASKS',
           'MIXTURES', 'DEMO_TASK']

register_tasks()
