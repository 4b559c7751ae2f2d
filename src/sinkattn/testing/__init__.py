"""What checks and times the library, apart from the library itself.

* ``precision``: the gates of the precision standard (docs/contract.md §4);
* ``cases``: the level tables (§5) as data, and seeded inputs;
* ``verify``: one case through the public API against the float64 golden;
* ``eager``: Hugging Face gpt-oss eager sink attention, the baseline of Gate B and the benchmarks;
* ``bench``, ``flops``: timing against peers in one run, FLOPs of visible pairs;
* ``options``: the ``sinkattn`` command's option values, each checked before any work.

Nothing in the library core (``sinkattn.interface`` and below) imports from here.
"""
