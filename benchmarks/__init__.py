"""agentrl's benchmarks, kept out of the library: each module is one command that prints JSON.

The folder is ``benchmarks/`` in the repository and installs as ``agentrl_benchmarks`` (like the
plugin folders, under a name no other package uses). Nothing in ``agentrl`` imports it; the
``agentrl bench`` subcommands only name these modules' ``main`` (``agentrl.cli.BENCHMARKS``):

* ``engine`` (``agentrl bench engine``): generated tokens/s of the built-in engine, static-batch
  ``generate`` and SGLang on multi-turn shaped requests;
* ``agent_loop`` (``agentrl bench agent-loop``): the agent layer's own cost per turn;
* ``trainer`` (``agentrl bench trainer``): agentrl's GRPO against TRL's ``GRPOTrainer``;
* ``forward`` (``agentrl bench forward``): the trainer's packed forward against the module path;
* ``data_reader`` (``python -m agentrl_benchmarks.data_reader``): shuffled batches from a large
  parquet file.

Every figure they measured, with its command, machine and date, is in ``docs/benchmarks.md``.
"""
