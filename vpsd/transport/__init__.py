"""transport"""
