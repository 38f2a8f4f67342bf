"""A procedural video world: seeded scenes of coloured shapes, their frames, captions and mp4 manifests.

Training and test data for tiny video-LLMs; imports nothing else from vpsd.
scene.py samples what happens, render.py draws it, caption.py says it, dataset.py writes it to disk.
"""
