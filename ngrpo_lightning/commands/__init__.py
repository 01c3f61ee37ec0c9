"""The ``ngrpo`` command: its entry point, the command line, and one module per subcommand."""
