"""The Lightning front doors over the engine (engine.py): the Trainer's strategy and its hooks, Fabric's
strategy, the plain-script engine, the precision plugin, and the callbacks that serve them."""
