"""What the compiler proves and computes about a program without a GPU: the tile
classification of a mask (`classify`), a score rule's derivative (`derivative`), the
scheduler's simulation on the host (`simulate`, with its cost model `costmodel`) and its
comparison with a traced launch (`trace`), the valid work of a launch and the ragged tile
index (`valid_work`), and the float64 NumPy references (`reference`).
"""
