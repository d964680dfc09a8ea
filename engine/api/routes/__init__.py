"""The engine's routes, one module per area; each route declares its role and audit action where it is defined."""
