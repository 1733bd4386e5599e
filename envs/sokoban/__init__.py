"""Sokoban, text and image: procedurally generated rooms solvable within the turn limit, and XSB levels."""

from envs.sokoban.env import ACTIONS, PRESETS, SokobanEnv, SokobanPreset, SokobanVisionEnv
from envs.sokoban.generator import GeneratedRoom, GenerationError, generate_room, reverse_search
from envs.sokoban.xsb import LevelCollection, LevelError, SokobanLevel, load_xsb, parse_xsb, split_xsb_collection

__all__ = [
    "ACTIONS",
    "PRESETS",
    "SokobanEnv",
    "SokobanPreset",
    "SokobanVisionEnv",
    "GeneratedRoom",
    "GenerationError",
    "generate_room",
    "reverse_search",
    "LevelCollection",
    "LevelError",
    "SokobanLevel",
    "load_xsb",
    "parse_xsb",
    "split_xsb_collection",
]
