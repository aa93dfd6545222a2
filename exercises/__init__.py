"""Your answers to the course's exercises. Each stub says its task; `make grade` checks them."""
