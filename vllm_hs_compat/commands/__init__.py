"""One module per ``vllm-hs-compat`` command; :mod:`vllm_hs_compat.cli` only dispatches.  Each module has
``add_parser(subparsers)`` (registers the command, sets ``func``) and ``run(args) -> int``."""
