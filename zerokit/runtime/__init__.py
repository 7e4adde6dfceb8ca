"""What every part that runs collectives shares, below the core and tensor parallelism alike:
bounded waits and where each rank is (``presence``), what a wait raises and how long it waits
(``timeouts``), and how a process that ran gloo collectives ends (``teardown``).

Imports nothing of zerokit outside this package (tests/test_import_rules.py), so the core,
tensor parallelism, pipelines and checkpoints use it without importing each other.
"""

from .timeouts import AgreementError, CollectiveTimeout, collective_timeout

__all__ = ["AgreementError", "CollectiveTimeout", "collective_timeout"]
