"""Configuration at the bottom of the package: the field vocabulary (``schema``), the value
checks (``values``), the ``--config`` YAML loader (``yaml_settings``) and the resolution of
a run's settings into the one frozen run (``resolve``). Nothing here parses a command line
(``megatron_jreg.commands.flags`` does) or reads files other than a settings file."""
