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
again with another vocabulary or data locations.
"""

from t5x_speed.tasks.demo import DEMO_SEQUENCE_LENGTH
from t5x_speed.tasks.demo import DEMO_TASK
from t5x_speed.tasks.registry import C4_PREFIX_LM
from t5x_speed.tasks.registry import C4_SPAN_CORRUPTION
from t5x_speed.tasks.registry import CNN_DAILYMAIL
from t5x_speed.tasks.registry import DEFAULT_VOCAB_PATH
from t5x_speed.tasks.registry import default_vocabulary
from t5x_speed.tasks.registry import FINETUNING_TASKS
from t5x_speed.tasks.registry import MIXTURES
from t5x_speed.tasks.registry import output_features
from t5x_speed.tasks.registry import PARACRAWL_ENDE
from t5x_speed.tasks.registry import PARACRAWL_PARAGRAPH_ENDE
from t5x_speed.tasks.registry import PARAGRAPH_DIR_ENV_VAR
from t5x_speed.tasks.registry import register_tasks
from t5x_speed.tasks.registry import register_translation_tsv_task
from t5x_speed.tasks.registry import SEQUENCE_LENGTH
from t5x_speed.tasks.registry import TASKS
from t5x_speed.tasks.registry import VOCAB_ENV_VAR
from t5x_speed.tasks.registry import WIKILINGUA_EN
from t5x_speed.tasks.registry import WMT_ENDE
from t5x_speed.tasks.sources import DatasetNotPreparedError
from t5x_speed.tasks.vocabularies import SentencePieceVocabulary
from t5x_speed.tasks.vocabularies import vocabulary_path
from t5x_speed.tasks.vocabularies import VocabularyNotReadableError

register_tasks()
