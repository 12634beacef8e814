"""Attention kernel designs ("backends") behind one interface, and their registry."""
