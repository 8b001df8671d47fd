"""placeholder"""
def torchtnt_demo(*a, **k): return {}
def main(): pass
