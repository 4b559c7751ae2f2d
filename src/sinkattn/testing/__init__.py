"""What checks and times the library, apart from the library itself: what users call in their own tests,
and what the ``sinkattn`` command (``sinkattn verify``, ``sinkattn bench``) runs.

* ``precision``: the gates of the precision standard (docs/contract.md §4);
* ``cases``: the level tables (§5) as data, and seeded inputs;
* ``verify``: one case through the public API against the float64 golden;
* ``eager``: Hugging Face gpt-oss eager sink attention, the baseline of Gate B and the benchmarks;
* ``bench``, ``flops``: timing against peers in one run, FLOPs of visible pairs;
* ``options``: the ``sinkattn`` command's option values, each checked before any work.

Nothing in the library (``sinkattn`` but this package and ``__main__``) imports from here, and nothing
here imports the test harness (``tests/harness``: launchers, audits, test models; not shipped).
"""
