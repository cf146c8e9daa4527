"""Step factory, optimizer and learning-rate schedules."""
