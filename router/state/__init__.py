"""What the router knows of the workers: directory, placements, admission, locality."""
