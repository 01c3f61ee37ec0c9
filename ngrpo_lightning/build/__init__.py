"""From a composed config to the objects of a run: components, models, data (one function per config group)."""
