"""The pure core: types, results, devices, kernel caches, the op registry, the tape, backward and jvp."""
