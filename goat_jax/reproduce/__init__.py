"""The report harness: the paper's experiments at one scale, one command -> REPORT.md + figures
(``python -m experiments.reproduce``; docs/experiments.md).

Modules, bottom to top (each imports only those above it in this list, never one below):

  notes        the tiny report's notes, one tuple per family (prose)
  stats        seeds and intervals: Estimate (mean ± 95% t over seeds), aggregate, verdicts
  suites       Suite / LMVariant / RetrievalVariant, SUITES, Job and plan(): which runs (x seeds)
  dna_bench    the genome model's train step compiled and timed (also experiments.bench_dna)
  lm_family    the language family: evaluations per job, headline checks, report sections
  vit_family   the vision family: the same for the ViTs
  dna_family   the DNA family: the same for the genome LMs (+ train-step memory via dna_bench)
  jobs         train one job (with a progress watcher), evaluate it by family (cached)
  paper_table  the paper runs' sizes, budgets and departures from the official recipes
  paper        the paper suite as shell commands for a cluster
  report       the report writer: one section per family, REPORT.md, results.json
  runner       one invocation: plan, train, evaluate, report (or the commands)
"""
