pytest_plugins = ["pddnet.emu._fixtures"]
