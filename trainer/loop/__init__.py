"""The training loop of one rank: fit (top to bottom) and what it uses: set-up and the steps'
batches (setup.py), evaluation and when it is due, the loaders (loaders.py; streams.py for an
IterableDataset), precision, the non-finite watch, stop signals and the ranks' agreement, the
watchdog.

May import: everything below the job (ringtrain.config and what it may). Never the job
(ringtrain.run) or the tools.
"""
