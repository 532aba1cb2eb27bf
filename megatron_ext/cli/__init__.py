"""The ``megatron-ext`` command (:mod:`.main`) and the tools' plumbing: the tools as subcommands
(:mod:`.tool_commands`), their quiet imports (:mod:`.quiet_tools`), the flag reference
(:mod:`.flag_reference`)."""
