"""``switchyard security-check``: probe a running system the way an attacker on the box would."""
