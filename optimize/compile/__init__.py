"""Engine methods (engine.method=...): each builds the engine an artifact ships; race/ picks one."""
