"""zerokit's command-line tools, apart from the library: the ``zerokit`` command (``cli``) and
what it runs — ``compare`` (and its report), ``plan`` (the dry run, pipelines included),
``verify``, ``launch``, the checkpoint commands (``checkpoint_cli``) — with the model contract
they share (``workload``). They use the library; the library never imports them
(tests/test_house.py holds that).
"""
