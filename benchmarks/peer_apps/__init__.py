"""The servers users would otherwise pick, each written as its own documentation shows.

These modules run in the peers' own virtual environments (``benchmarks.peer_servers`` makes
them), not in batchserve's: only ``classifier`` is shared, and it needs nothing but torch,
torchvision and Pillow.
"""
