"""Rank routines per framework: each module drives that framework's own code in fresh rank interpreters and imports
no fsdp_compat adapter itself (whatever patches the framework is the installed package's start-up hook)."""
