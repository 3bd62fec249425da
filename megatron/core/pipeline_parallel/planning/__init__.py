"""Pure pipeline planning: schedules as data, validation, lowering, simulation (no torch import)."""
