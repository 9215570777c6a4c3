"""Benchmarks behind ``positronic-brain bench``.

- ``speed``: stage 1 vs Hugging Face decode, prefill, bytes allocated per step, loop
  overhead, cull/repair/re-index costs, memory bandwidth and peak RSS.
- ``passkey``: pass-key retrieval accuracy, the full cache vs every scorer and budget.
- ``ruler``: RULER's tasks (``ruler_tasks``: generated offline) under three protocols
  (compress once, online, chunked), the full cache vs every scorer and compression ratio.
- ``transfer``: caches carried into another context (composed sessions against a joint
  prefill, with CacheBlend's selective recompute).
- ``common``: what every benchmark shares (timing, allocation counting, machine facts,
  tables, plots, report files).
"""
