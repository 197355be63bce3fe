"""Model layers written against the Backend ops only, so every backend runs the same model code."""
