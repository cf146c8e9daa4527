"""What a layout costs before any rank starts: memory per rank, the collectives of one step,
pipeline bubbles, the dry run that `meshtrain plan` prints and the search for layouts that fit."""
