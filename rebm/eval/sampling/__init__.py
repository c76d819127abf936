"""The samples: class-conditional generation from seed images (generation.py), the one
generation pass the sample metrics share (samples.py) and FID's adaptive step sweep (sweep.py)."""
