"""The control plane's processes. Importing the package reads the one fast-path switch
(POOL_FAST_PATHS, workers.fastpaths), so every process of the plane is set by it at start."""

from workers import fastpaths as fastpaths
