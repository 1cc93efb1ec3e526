"""Attention kernels shared by the server (training) and the client's local engine.

    tree_attention.py   jetctl_tree: tree-packed rows attend per trie segment
"""
