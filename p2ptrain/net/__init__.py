"""p2ptrain.net"""
