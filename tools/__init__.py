"""Developer tools of t5x_speed: the demo, the benches and the exactness fuzz.

Run from the repository root as modules (`python -m tools.demo`); they are
not installed with the package, and the package never imports them.

Commands:
  demo                  trains a small shared model on a generated task and
                        decodes it with greedy and SPEED (`make demo`).
  bench                 SPEED against greedy at T5-Base width, replaying a
                        trained demo model's schedules (`make bench`).
  sample_bench          SPEED sampling against sequential sampling
                        (`make sample-bench`).
  fuzz                  SPEED == greedy == an uncached forward pass on random
                        models (`make fuzz`).
  gettext_data          a real English->French translation set built from
                        the system's gettext catalogs (never committed).
  paper_table           the paper's comparison in miniature on that set, and
                        exits trained to agree (`make paper-table`).

Shared modules:
  common         help layout, progress lines on stderr, timing, host name.
  demo_model     the demo model: settings, training, held-out prompts.
  replay         recording a demo model's SPEED schedule and replaying it on
                 a wide model (the benches' and the demo's wide numbers).
  bench_measure  the bench's timed row groups; bench_report its table.
  trainer        optax training with the multi-exit loss, exit consistency.
  paper_table_report  the paper table's markdown, JSON and plot.
  fuzz_cases     the fuzz's random cases; fuzz_check its checks and counts.
"""
